"""A griffe extension: the package's reST habits in docstrings, read as Markdown.

The docstrings use Sphinx roles (``:func:`ring_all_reduce```, ``:mod:`~collectives.core.trace```)
and reST literal blocks (a paragraph ending in ``::`` followed by an indented block).
mkdocstrings reads Markdown, so on the API pages both showed as raw text. This extension
rewrites them while the package is loaded for the site, leaving the source as it is:

* a role becomes a cross-reference to the documented object when the name resolves
  (in the object's module, its imports, then the package), else inline code;
* ``text::`` + indented block becomes ``text:`` + a fenced text block, so diagrams and
  cost tables keep their lines;
* a module's page shows only what the module defines: names it re-exports from another
  module (``__all__``) are documented where they are defined.

Named in mkdocs.yml (``extensions:`` of the python handler).
"""

from __future__ import annotations

import re
import textwrap

import griffe

ROLE = re.compile(r":(?:py:)?(func|mod|class|meth|attr|data|exc|obj|const):`(~?)([^`<]+?)`")


def _module_of(obj):
    while obj is not None and not getattr(obj, "is_module", False):
        obj = obj.parent
    return obj


def _documented(path: str, collection) -> bool:
    if not path.startswith("collectives") or any(p.startswith("_") for p in path.split(".")):
        return False
    try:
        target = collection.get_member(path) if hasattr(collection, "get_member") else collection[path]
    except (KeyError, ValueError, AttributeError, griffe.AliasResolutionError, griffe.CyclicAliasError):
        return False
    try:
        if getattr(target, "is_alias", False):
            target = target.final_target
    except (griffe.AliasResolutionError, griffe.CyclicAliasError):
        return False
    # the API pages show modules, and other objects only when they have a docstring
    return target is not None and (target.is_module or target.docstring is not None)


def _resolve(name: str, obj, collection) -> str | None:
    module = _module_of(obj)
    head, _, rest = name.partition(".")
    candidates = []
    scopes = [obj, obj.parent, module] if obj is not None else [module]
    for scope in scopes:
        if scope is not None and head in getattr(scope, "members", {}):
            candidates.append(f"{scope.path}.{name}")
    if module is not None and head in module.imports:
        candidates.append(module.imports[head] + (f".{rest}" if rest else ""))
    candidates += [name, f"collectives.{name}", f"collectives.core.{name}", f"collectives.course.{name}"]
    for path in candidates:
        if _documented(path, collection):
            try:
                target = collection[path]
                return target.final_target.path if getattr(target, "is_alias", False) else target.path
            except Exception:   # resolution failed after all: plain code
                continue
    return None


def rewrite(text: str, obj=None, collection=None) -> str:
    def role(match):
        tilde, name = match.group(2), match.group(3).strip()
        shown = name.rsplit(".", 1)[-1] if tilde else name
        if match.group(1) in ("func", "meth"):
            shown += "()" if not shown.endswith(")") else ""
        target = _resolve(name, obj, collection) if collection is not None else None
        return f"[`{shown}`][{target}]" if target else f"`{shown}`"

    text = ROLE.sub(role, text)
    return _literal_blocks(text)


def _literal_blocks(text: str) -> str:
    lines = text.split("\n")
    out, i = [], 0
    while i < len(lines):
        line = lines[i]
        if not line.rstrip().endswith("::"):
            out.append(line)
            i += 1
            continue
        stripped = line.rstrip()[:-2].rstrip()
        if stripped:
            out.append(stripped + ":")
        indent = len(line) - len(line.lstrip())
        j = i + 1
        while j < len(lines) and not lines[j].strip():
            j += 1
        block = []
        while j < len(lines) and (not lines[j].strip()
                                  or len(lines[j]) - len(lines[j].lstrip()) > indent):
            block.append(lines[j])
            j += 1
        while block and not block[-1].strip():
            block.pop()
        if not block:
            i += 1
            continue
        pad = " " * indent
        body = textwrap.dedent("\n".join(block))
        out += ["", pad + "```text"] + [pad + line if line else "" for line in body.split("\n")] + [pad + "```", ""]
        i = j
    return "\n".join(out)


class SphinxRolesToMarkdown(griffe.Extension):
    """Rewrite roles and literal blocks in every docstring of the loaded package."""

    def on_package(self, *, pkg, loader, **kwargs) -> None:
        collection = loader.modules_collection
        seen = set()

        def walk(obj):
            if id(obj) in seen or getattr(obj, "is_alias", False):
                return
            seen.add(id(obj))
            if obj.docstring is not None:
                obj.docstring.value = rewrite(obj.docstring.value, obj, collection)
            if getattr(obj, "is_module", False) and obj.exports:
                # each page only its module: names a module re-exports from another
                # (ring exports topologies' algorithms) are documented where they live
                obj.exports = [name for name in obj.exports
                               if not getattr(obj.members.get(name), "is_alias", False)]
            for member in list(obj.members.values()):
                walk(member)

        walk(pkg)
