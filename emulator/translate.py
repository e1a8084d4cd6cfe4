#!/usr/bin/env python3
"""Turns a .cu file into C++ for the CUDA emulator (emulator/README.md).

Each launch `NAME<<<grid, block[, shared[, stream]]>>>(args)` becomes
`::unetcu_emu::launch<B>("NAME", {grid, block, ...}, [=](auto... a) { NAME(a...); })(args)`,
where B says whether the kernel uses barriers or warp shuffles (its threads then run as
fibers): a kernel does when its body, or a __device__ function it names, calls __syncthreads,
a __shfl_*_sync or another such function. Everything else is left as it is; the emulator's
<cuda_runtime.h> defines the qualifiers and the thread coordinates.

Usage: translate.py IN.cu OUT.cpp [--scan HEADER ...]   (headers whose __device__ functions
the .cu file calls, for the barrier analysis)
"""
import re
import sys

BARRIER_TOKENS = {"__syncthreads", "__shfl_down_sync", "__shfl_xor_sync", "__shfl_up_sync",
                  "__shfl_sync", "__syncwarp"}


def strip_comments(text):
    text = re.sub(r"//[^\n]*", "", text)
    return re.sub(r"/\*.*?\*/", "", text, flags=re.S)


def match_forward(text, i, open_c, close_c):
    """Index just past the bracket matching text[i] == open_c."""
    depth = 0
    for j in range(i, len(text)):
        if text[j] == open_c:
            depth += 1
        elif text[j] == close_c:
            depth -= 1
            if depth == 0:
                return j + 1
    raise SystemExit(f"translate.py: unbalanced {open_c}{close_c}")


def functions(text, qualifier):
    """(name, body) of each function definition marked `qualifier`."""
    out = []
    for m in re.finditer(r"\b" + qualifier + r"\b", text):
        paren = text.find("(", m.end())
        head = text[m.end():paren]
        names = re.findall(r"[A-Za-z_]\w*", head)
        if not names:
            continue
        end_params = match_forward(text, paren, "(", ")")
        k = end_params
        while k < len(text) and text[k] not in "{;":
            k += 1
        if k >= len(text) or text[k] == ";":
            continue  # a declaration
        out.append((names[-1], text[k:match_forward(text, k, "{", "}")]))
    return out


def barrier_kernels(sources):
    code = "\n".join(strip_comments(s) for s in sources)
    uses = set(BARRIER_TOKENS)
    device = functions(code, "__device__")
    changed = True
    while changed:  # __device__ functions calling ones that use barriers
        changed = False
        for name, body in device:
            if name not in uses and uses & set(re.findall(r"[A-Za-z_]\w*", body)):
                uses.add(name)
                changed = True
    return {name for name, body in functions(code, "__global__")
            if uses & set(re.findall(r"[A-Za-z_]\w*", body))}


def kernel_name_start(text, i):
    """Start of the launched expression ending at text[i] (exclusive): NAME or NAME<...>."""
    j = i
    while j > 0 and text[j - 1].isspace():
        j -= 1
    if text[j - 1] == ">":  # template arguments
        depth = 0
        while j > 0:
            j -= 1
            if text[j] == ">":
                depth += 1
            elif text[j] == "<":
                depth -= 1
                if depth == 0:
                    break
    while j > 0 and (text[j - 1].isalnum() or text[j - 1] in "_:"):
        j -= 1
    return j


def translate(text, barrier_set):
    out, pos = [], 0
    while True:
        i = text.find("<<<", pos)
        if i < 0:
            out.append(text[pos:])
            return "".join(out)
        start = kernel_name_start(text, i)
        name_expr = text[start:i].strip()
        base = re.match(r"[\w:]+", name_expr).group(0).split("::")[-1]
        end = text.find(">>>", i)
        config = text[i + 3:end]  # newlines kept: the line numbers stay the source's
        flag = "true" if base in barrier_set else "false"
        out.append(text[pos:start])
        out.append(f'::unetcu_emu::launch<{flag}>("{base}", ::unetcu_emu::Config({config}), '
                   f'[=](const auto&... emu_a) {{ {name_expr}(emu_a...); }})')
        pos = end + 3


def main(argv):
    if len(argv) < 3:
        raise SystemExit(__doc__)
    src, dst, scan = argv[1], argv[2], []
    rest = argv[3:]
    if rest and rest[0] == "--scan":
        scan = [open(p).read() for p in rest[1:]]
    text = open(src).read()
    kernels = barrier_kernels([text] + scan)
    result = (f"// Generated from {src} by emulator/translate.py for the CUDA emulator; "
              f"barrier kernels: {', '.join(sorted(kernels)) or 'none'}.\n"
              f'#line 1 "{src}"\n' + translate(text, kernels))
    tmp = dst + ".tmp"
    with open(tmp, "w") as f:
        f.write(result)
    import os
    os.replace(tmp, dst)


if __name__ == "__main__":
    main(sys.argv)
