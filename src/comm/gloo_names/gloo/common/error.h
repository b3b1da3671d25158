// Stands in for gloo's header of that name, for c10d's ProcessGroupGloo.hpp only (README.md).
#pragma once
