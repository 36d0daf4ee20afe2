"""Write the op schemas the _C_stable_libtorch stand-in defines, for one staged vLLM version.

usage: python3 extract_schemas.py WHEEL_SO PY_TREE OUT_TXT
       python3 extract_schemas.py --check WHEEL_SO STANDIN_PY   (its SCHEMAS must be the .so's)
  WHEEL_SO  the real vllm/_C_stable_libtorch.abi3.so of that version (from its wheel)
  PY_TREE   the unpacked vllm/ Python package of the same version
  OUT_TXT   one schema a line (vllm/_C_stable_libtorch_schemas.txt in the staged tree)

Kept: every schema string of the .so whose op the Python source names as torch.ops._C.<op>,
except ops it feature-detects (hasattr/getattr(torch.ops._C, "<op>")): leaving those undefined
makes vLLM take its Triton/native fallback. Two exceptions: ops taken unguarded at import time
(TAKEN_AT_IMPORT) stay, and the two ops whose Python callers apply_patches.py replaces are left
out. On 0.32.0 this gives exactly the 81 schemas the first hand-made stand-in carried.
"""
import ast
import pathlib
import re
import sys

# Their callers in vllm/utils/torch_utils.py get pure-Python versions (apply_patches.py).
REPLACED = {"weak_ref_tensor", "get_cuda_view_from_cpu_tensor"}
# compilation/passes/fusion/{matcher_utils,rms_quant_fusion}.py take .default at import.
TAKEN_AT_IMPORT = {"static_scaled_fp8_quant"}
SCHEMA = re.compile(r"^([a-z_][a-z0-9_]*)\((.*)\) -> .+$")


def so_schemas(path: str) -> dict[str, str]:
    schemas: dict[str, str] = {}
    for match in re.finditer(rb"[\x20-\x7e]{6,}", pathlib.Path(path).read_bytes()):
        text = match.group().decode()
        parsed = SCHEMA.match(text)
        if parsed:
            schemas.setdefault(parsed.group(1), text)
    return schemas


def python_references(tree: str) -> tuple[set[str], set[str]]:
    named, detected = set(), set()
    for source in pathlib.Path(tree).rglob("*.py"):
        text = source.read_text(errors="ignore")
        named |= set(re.findall(r"torch\.ops\._C\.([A-Za-z0-9_]+)", text))
        detected |= set(re.findall(
            r"(?:hasattr|getattr)\(\s*torch\.ops\._C\s*,\s*[\"']([A-Za-z0-9_]+)", text))
    return named, detected


def check_standin(so_path: str, standin: str) -> None:
    """Every schema the pure-Python stand-in ``standin`` (a file with a SCHEMAS dict) defines
    must be the real .so's, whitespace aside: a changed signature fails the build, not the
    device run."""
    # read, not imported: the build machine's python3 need not have torch
    tree = ast.parse(pathlib.Path(standin).read_text(), standin)
    standin_schemas = next(ast.literal_eval(node.value) for node in tree.body
                           if isinstance(node, ast.Assign)
                           and getattr(node.targets[0], "id", None) == "SCHEMAS")
    real = {name: " ".join(text.split()) for name, text in so_schemas(so_path).items()}
    for name, schema in standin_schemas.items():
        if real.get(name) != " ".join(schema.split()):
            raise SystemExit(f"{standin}: schema of {name} differs from {so_path}:\n"
                             f"  stand-in {schema}\n  real     {real.get(name)}")
    print(f"{len(standin_schemas)} stand-in schemas match {so_path}")


def main() -> None:
    if sys.argv[1] == "--check":
        check_standin(*sys.argv[2:4])
        return
    so_path, tree, out = sys.argv[1:4]
    schemas = so_schemas(so_path)
    named, detected = python_references(tree)
    kept = sorted(
        name for name in schemas
        if name in named and name not in REPLACED and (name not in detected or name in TAKEN_AT_IMPORT)
    )
    pathlib.Path(out).write_text("".join(schemas[name] + "\n" for name in kept))
    print(f"{len(kept)} schemas of {len(schemas)} in the .so -> {out}")


if __name__ == "__main__":
    main()
