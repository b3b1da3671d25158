#!/bin/sh
# OpenMPI's launch agent (mpirun --mca plm_rsh_agent) for the hosts of hosts.py: where mpirun
# would `ssh <host> <command>`, this runs the command inside that host, whose network namespace
# is named as the host: in its own pid namespace and with the host's name, as Hosts.start does.
while [ "${1#-}" != "$1" ]; do shift; done  # ssh's options, should OpenMPI pass any
host=$1
shift
exec ip netns exec "$host" unshare --pid --uts --fork --kill-child \
  sh -c 'hostname "$0" && exec /bin/sh -c "$1"' "$host" "$*"
