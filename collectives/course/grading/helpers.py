"""The helper sheet at the top of every exercise: the course functions a student may call.

Each exercise's docstring carries a block like::

    Course functions you may call (collectives.core; the sheet is checked against the code):

        ops.work_buffer(tensor) -> Tensor
            A flat, contiguous buffer holding ``tensor``'s elements: the tensor's own memory when ...

one signature and the first line of the function's own docstring per entry, and each stub's
docstring says which entries its task needs (``CALLS: ops.work_buffer, ops.sendrecv``).
:func:`sheet` writes the block from the code itself; ``tests/test_helper_sheets.py``
fails when an exercise's block is not what :func:`sheet` writes today, and
``.venv/bin/python -m collectives helpers --lesson 4`` prints it afresh.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import inspect
import re
import textwrap
from pathlib import Path

HEADER = "Course functions you may call (the sheet is checked against the code):"
INDENT = "    "
WIDTH = 92


def resolve(name: str):
    """``"ops.work_buffer"`` -> the function, looked up as an exercise's imports name it."""
    module_name, _, attr = name.rpartition(".")
    owners = {"ops": "collectives.core.ops", "trace": "collectives.core.trace", "cost": "collectives.core.cost",
              "streams": "collectives.core.streams", "timing": "collectives.core.timing",
              "launch": "collectives.core.launch", "verify": "collectives.course.verify",
              "nccl_memory": "collectives.core.nccl_memory", "p2p": "collectives.p2p",
              "dumps": "collectives.debugging.dumps"}
    module = importlib.import_module(owners.get(module_name, module_name))
    obj = module
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def _default(value) -> str:
    text = repr(value)
    match = re.match(r"<RedOpType\.(\w+): \d+>", text)
    return f"ReduceOp.{match.group(1)}" if match else text


def signature(name: str) -> str:
    """``ops.sendrecv(send_buf, dst, recv_buf, src, group=None, *, post_empty=False)``."""
    fn = resolve(name)
    sig = inspect.signature(fn)
    parts, star = [], False
    for p in sig.parameters.values():
        if p.kind == p.VAR_POSITIONAL:
            parts.append(f"*{p.name}")
            star = True
            continue
        if p.kind == p.VAR_KEYWORD:
            parts.append(f"**{p.name}")
            continue
        if p.kind == p.KEYWORD_ONLY and not star:
            parts.append("*")
            star = True
        parts.append(p.name if p.default is p.empty else f"{p.name}={_default(p.default)}")
    ret = sig.return_annotation
    shown = ret if isinstance(ret, str) else getattr(ret, "__name__", ret)
    tail = "" if ret is sig.empty or inspect.isclass(fn) else f" -> {shown}"
    return f"{name}({', '.join(parts)}){tail}"


def summary(name: str) -> str:
    doc = inspect.getdoc(resolve(name)) or ""
    first = doc.split("\n\n", 1)[0].replace("\n", " ").strip()
    return first


def sheet(names: list[str]) -> str:
    """The block for ``names``, as it appears (indented) in an exercise's docstring."""
    lines = [HEADER, ""]
    for name in names:
        text = signature(name)
        head = INDENT + text[: text.index("(") + 1]
        lines += textwrap.wrap(text[len(head) - len(INDENT):], WIDTH + len(INDENT) - 1, initial_indent=head,
                               subsequent_indent=" " * len(head), break_on_hyphens=False)
        lines += textwrap.wrap(summary(name), WIDTH, initial_indent=INDENT * 2, subsequent_indent=INDENT * 2)
    return "\n".join(lines)


def names_in(docstring: str) -> list[str]:
    """The names an exercise's sheet lists, in order."""
    if HEADER not in docstring:
        return []
    block = docstring.split(HEADER, 1)[1]
    out = []
    for line in block.splitlines()[1:]:
        if line.startswith(INDENT) and line[len(INDENT)] != " " and "(" in line:
            out.append(line.strip().split("(", 1)[0])
        elif line.strip() and not line.startswith(INDENT):
            break
    return out


def block_in(docstring: str) -> str:
    """The sheet as it stands in ``docstring`` (from the header to the last indented line)."""
    if HEADER not in docstring:
        return ""
    head, rest = docstring.split(HEADER, 1)
    kept = [HEADER]
    for line in rest.splitlines()[1:]:
        if line.strip() and not line.startswith(INDENT):
            break
        kept.append(line)
    while kept and not kept[-1].strip():
        kept.pop()
    return "\n".join(kept)


def calls_of(path: Path) -> dict[str, list[str]]:
    """Each stub's ``CALLS:`` line: {function: [sheet names]}."""
    tree = ast.parse(Path(path).read_text())
    out = {}
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            doc = ast.get_docstring(node) or ""
            match = re.search(r"^CALLS:\s*(.+?)(?:\n\S|\n\n|\Z)", doc, re.M | re.S)
            if match:
                out[node.name] = [n.strip(" .`") for n in re.split(r"[,\s]+", match.group(1)) if n.strip(" .`")]
    return out


def main(argv: list[str] | None = None) -> int:
    from ..catalog import lesson

    parser = argparse.ArgumentParser(prog=".venv/bin/python -m collectives helpers",
                                     description="print an exercise's helper sheet, written from the code")
    parser.add_argument("--lesson", type=int, required=True)
    args = parser.parse_args(argv)
    doc = ast.get_docstring(ast.parse(lesson(args.lesson).exercise.read_text())) or ""
    print(sheet(names_in(doc)))
    return 0
