#!/usr/bin/env python3
"""An independent reader of a sharded safetensors checkpoint, written from the format's
specification only (struct + json), used by tests/checkpoint/test_safetensors.cpp to check fsdp-cpp's
writer against a torch.save'd reference.

  read_safetensors.py DIR/model.safetensors.index.json REFERENCE.pt

Reads the Hugging Face index and every file it names, decodes each tensor from the raw bytes,
and compares it exactly (dtype, shape, values) with torch.load(REFERENCE.pt). Prints every
difference and exits 1 if there is any; prints a one-line summary and exits 0 otherwise.

Format: u64 little-endian header length N; N bytes of JSON {name: {"dtype", "shape",
"data_offsets": [begin, end]}, "__metadata__": {str: str}}; then the data, offsets relative to
its start, covered exactly by the tensors.
"""
import json
import os
import struct
import sys

import torch

DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
}

errors = []


def error(msg):
    errors.append(msg)
    print("ERROR:", msg)


def read_file(path):
    """name -> tensor, checking the layout rules of the format (and our 8-byte alignment)."""
    with open(path, "rb") as f:
        blob = f.read()
    (n,) = struct.unpack("<Q", blob[:8])
    if 8 + n > len(blob):
        error(f"{path}: header length {n} exceeds the file")
        return {}
    header = json.loads(blob[8:8 + n].decode("utf-8"))
    if (8 + n) % 8 != 0:
        error(f"{path}: data starts at {8 + n}, not 8-byte aligned")
    if header.get("__metadata__", {}).get("format") != "pt":
        error(f"{path}: __metadata__ lacks format=pt: {header.get('__metadata__')}")
    data = blob[8 + n:]
    out, spans = {}, []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin, end = info["data_offsets"]
        dtype, shape = DTYPES[info["dtype"]], info["shape"]
        numel = 1
        for s in shape:
            numel *= s
        if end - begin != numel * torch.empty((), dtype=dtype).element_size():
            error(f"{path}: {name}: {end - begin} bytes for shape {shape} {info['dtype']}")
            continue
        spans.append((begin, end, name))
        raw = bytearray(data[begin:end])
        flat = torch.frombuffer(raw, dtype=dtype) if raw else torch.empty(0, dtype=dtype)
        out[name] = flat.reshape(shape)
    cursor = 0
    for begin, end, name in sorted(spans):
        if begin != cursor:
            error(f"{path}: {name} starts at {begin}, expected {cursor} (hole or overlap)")
        cursor = end
    if cursor != len(data):
        error(f"{path}: tensors cover {cursor} of {len(data)} data bytes")
    return out


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    assert sys.byteorder == "little", "this reader decodes with the host's byte order"
    index_path, reference_path = sys.argv[1], sys.argv[2]
    with open(index_path) as f:
        index = json.load(f)
    weight_map = index["weight_map"]
    reference = torch.load(reference_path)
    directory = os.path.dirname(index_path)

    decoded, total = {}, 0
    for file in sorted(set(weight_map.values())):
        tensors = read_file(os.path.join(directory, file))
        expected = sorted(k for k, v in weight_map.items() if v == file)
        if sorted(tensors) != expected:
            error(f"{file} holds {sorted(tensors)} but the index maps {expected} to it")
        for name, t in tensors.items():
            if name in decoded:
                error(f"{name} appears in more than one file")
            decoded[name] = t
            total += t.numel() * t.element_size()

    if total != index["metadata"]["total_size"]:
        error(f"total_size is {index['metadata']['total_size']} but the tensors hold {total} bytes")
    if sorted(decoded) != sorted(reference):
        error(f"names differ: only in files {sorted(set(decoded) - set(reference))}, "
              f"only in the reference {sorted(set(reference) - set(decoded))}")
    for name, ref in reference.items():
        got = decoded.get(name)
        if got is None:
            continue
        if got.dtype != ref.dtype or list(got.shape) != list(ref.shape):
            error(f"{name}: {got.dtype} {list(got.shape)} in the files, {ref.dtype} {list(ref.shape)} in the reference")
        elif not torch.equal(got, ref):
            error(f"{name}: values differ (max |diff| {(got.double() - ref.double()).abs().max().item()})")

    if errors:
        sys.exit(1)
    print(f"OK: {len(decoded)} tensors in {len(set(weight_map.values()))} files, total_size {total}")


if __name__ == "__main__":
    main()
