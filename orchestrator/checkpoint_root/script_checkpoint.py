"""Where an unmodified torchrun script keeps its own checkpoint, read from its source.

A restart-tier job resumes from whatever checkpoint its script wrote: after a
failure every worker starts again and loads it, a spare included.  Where that
file goes decides whether recovery resumes or starts from zero, so ``ringmaster
validate``, ``submit`` and ``run`` say it (:mod:`orchestrator.checkpoint_root.reach`
says who can see it).

:func:`find_saves` reads the entrypoint (and the modules beside it that it
imports) with :mod:`ast` and follows the path given to ``torch.save`` (or to
``torch.distributed.checkpoint.save(..., checkpoint_id=...)``) back to what
it is made of: string constants, environment variables
(``os.environ.get("RINGMASTER_CHECKPOINT_DIR")``), ``argparse`` defaults
(overridden by the job's ``entrypoint.args``), parameter defaults and the
arguments of the calls that pass it on, joined by ``/``, ``+``,
``os.path.join``, ``Path(...)`` and f-strings.  The reading is flow-insensitive
and bounded: a name assigned in several places gives several alternatives, and
what it cannot follow (a value computed at run time, a config file) is kept as a
``{hole}``.  Runs in the CLI (``validate``, ``submit``, ``run``).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["Part", "Save", "find_saves"]

#: How deep a value is followed through names, and how many alternatives one keeps.
MAX_DEPTH = 12
MAX_ALTERNATIVES = 8
#: Calls that return their (first) argument's path, or join their arguments as one.
_PASS_THROUGH = {
    "str",
    "fspath",
    "expanduser",
    "abspath",
    "realpath",
    "normpath",
    "resolve",
    "expandvars",
    "absolute",
    "with_suffix",
    "with_name",
    "open",
}
_JOINS = {"join", "Path", "PurePath", "PosixPath", "joinpath"}


@dataclass(frozen=True)
class Part:
    """One piece of a path: a constant, an environment variable, or what cannot be read."""

    text: str
    kind: str = "text"  # "text", "env" (text is the variable's name) or "hole"

    def shown(self) -> str:
        return {"env": f"${self.text}", "hole": f"{{{self.text}}}"}.get(self.kind, self.text)


Alternative = tuple[Part, ...]


@dataclass(frozen=True)
class Save:
    """A place where the script saves a checkpoint, and where in its source that is."""

    parts: Alternative
    file: str
    line: int
    call: str

    @property
    def shown(self) -> str:
        """The path as people read it: ``$RINGMASTER_CHECKPOINT_DIR/ckpt-{step}.pt``."""
        return "".join(p.shown() for p in self.parts)

    @property
    def env(self) -> str | None:
        """The environment variable the path starts with, if any."""
        return self.parts[0].text if self.parts and self.parts[0].kind == "env" else None


@dataclass
class _Module:
    """Every binding of a name in the files read (flow-insensitive)."""

    values: dict[str, list[ast.expr]] = field(default_factory=dict)
    #: parameter name -> (function name, position, called as a method: ``obj.f(...)``)
    params: dict[str, list[tuple[str, int, bool]]] = field(default_factory=dict)
    calls: dict[str, list[ast.Call]] = field(default_factory=dict)
    #: ``--flag`` -> the argparse destination it sets
    options: dict[str, str] = field(default_factory=dict)
    saves: list[tuple[str, ast.Call, ast.expr]] = field(default_factory=list)

    def bind(self, name: str, value: ast.expr | None) -> None:
        if value is not None:
            self.values.setdefault(name, []).append(value)


def find_saves(path: Path, args: Sequence[str] = ()) -> list[Save]:
    """Every checkpoint save found in the script at ``path`` (and the local modules it
    imports), each with the path it saves to; empty when none is found."""
    files = _local_files(path)
    module = _Module()
    for name, tree in files:
        _index(tree, name, module)
    overrides = _flag_values(args)
    out: list[Save] = []
    for file, call, target in module.saves:
        alts = _Resolver(module, overrides).value(target, 0)
        for alt in alts or [(Part(ast.unparse(target), "hole"),)]:
            save = Save(_merge(alt), file, call.lineno, ast.unparse(call.func))
            if save not in out:
                out.append(save)
    return out


def _local_files(path: Path) -> list[tuple[str, ast.Module]]:
    """The script and the modules in its directory that it imports (one level)."""
    out: list[tuple[str, ast.Module]] = []
    try:
        tree = ast.parse(path.read_text(encoding="utf-8", errors="replace"))
    except (OSError, SyntaxError, ValueError):
        return out
    out.append((path.name, tree))
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        for name in names:
            local = path.parent / (name.replace(".", "/") + ".py")
            if local.is_file() and local != path and all(f != local.name for f, _ in out):
                try:
                    out.append((local.name, ast.parse(local.read_text(encoding="utf-8"))))
                except (OSError, SyntaxError, ValueError):
                    continue
    return out


def _last_name(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def _index(tree: ast.Module, file: str, module: _Module) -> None:
    methods = {
        id(item)
        for c in ast.walk(tree)
        if isinstance(c, ast.ClassDef)
        for item in c.body
        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef))
    }
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if (name := _last_name(target)) is not None:
                    module.bind(name, node.value)
        elif isinstance(node, ast.AnnAssign) and (name := _last_name(node.target)):
            module.bind(name, node.value)
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    # Trainer(a, b) calls __init__(self, a, b); obj.save(a) calls save(self, a)
                    if item.name == "__init__":
                        _index_params(item, node.name, 1, False, module)
                    else:
                        _index_params(item, item.name, 1, True, module)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            if id(node) not in methods:
                _index_params(node, node.name, 0, False, module)
        elif isinstance(node, ast.Call):
            _index_call(node, file, module)


def _index_params(
    fn: ast.FunctionDef | ast.AsyncFunctionDef,
    called: str,
    skip: int,
    method: bool,
    module: _Module,
) -> None:
    """Bind each parameter to its default; remember its position for the call sites."""
    positional = fn.args.posonlyargs + fn.args.args
    defaults = [None] * (len(positional) - len(fn.args.defaults)) + list(fn.args.defaults)
    for i, (arg, default) in enumerate(zip(positional, defaults, strict=True)):
        if i >= skip:
            module.params.setdefault(arg.arg, []).append((called, i - skip, method))
        module.bind(arg.arg, default)
    for arg, kw_default in zip(fn.args.kwonlyargs, fn.args.kw_defaults, strict=True):
        module.params.setdefault(arg.arg, []).append((called, -1, method))
        module.bind(arg.arg, kw_default)


def _index_call(call: ast.Call, file: str, module: _Module) -> None:
    name = _last_name(call.func)
    if name is None:
        return
    module.calls.setdefault(name, []).append(call)
    if name == "add_argument":
        _index_option(call, module)
        return
    dotted = ast.unparse(call.func)
    kws = {k.arg: k.value for k in call.keywords if k.arg}
    target: ast.expr | None = None
    if dotted in ("torch.save", "th.save"):
        target = kws.get("f") or (call.args[1] if len(call.args) > 1 else None)
    elif name == "save" and ("checkpoint" in dotted or dotted.startswith("dcp.")):
        target = kws.get("checkpoint_id")  # torch.distributed.checkpoint.save(...)
    if target is not None:
        module.saves.append((file, call, target))


def _index_option(call: ast.Call, module: _Module) -> None:
    """``parser.add_argument("--ckpt-dir", default=...)``: its default, and its flags."""
    flags = [a.value for a in call.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
    kws = {k.arg: k.value for k in call.keywords if k.arg}
    long = [f for f in flags if f.startswith("--")]
    dest_node = kws.get("dest")
    dest = dest_node.value if isinstance(dest_node, ast.Constant) else None
    if dest is None and flags:
        dest = (long or flags)[0].lstrip("-").replace("-", "_")
    if isinstance(dest, str):
        module.bind(dest, kws.get("default"))
        for flag in long:
            module.options[flag] = dest


def _flag_values(args: Sequence[str]) -> dict[str, str]:
    """``--flag value`` and ``--flag=value`` pairs of the job's arguments."""
    out: dict[str, str] = {}
    for i, arg in enumerate(args):
        if not arg.startswith("--"):
            continue
        if "=" in arg:
            flag, _, value = arg.partition("=")
            out[flag] = value
        elif i + 1 < len(args) and not args[i + 1].startswith("--"):
            out[arg] = args[i + 1]
    return out


def _merge(alt: Alternative) -> Alternative:
    """Neighbouring constants as one part."""
    out: list[Part] = []
    for part in alt:
        if out and part.kind == "text" and out[-1].kind == "text":
            out[-1] = Part(out[-1].text + part.text)
        elif part.text or part.kind != "text":
            out.append(part)
    return tuple(out)


class _Resolver:
    """Follows an expression back to the constants and variables it is made of."""

    def __init__(self, module: _Module, overrides: dict[str, str]) -> None:
        self.m = module
        self.overrides = overrides
        self._busy: set[int] = set()

    def value(self, node: ast.expr, depth: int) -> list[Alternative]:
        """The alternatives ``node`` may be; none where it only leads back to itself
        (or is ``None``), a hole where it cannot be followed further."""
        if id(node) in self._busy:
            return []
        if depth > MAX_DEPTH:
            return [(Part(ast.unparse(node), "hole"),)]
        self._busy.add(id(node))
        try:
            return list(dict.fromkeys(self._value(node, depth)))[:MAX_ALTERNATIVES]
        finally:
            self._busy.discard(id(node))

    def _value(self, node: ast.expr, depth: int) -> Iterator[Alternative]:
        if isinstance(node, ast.Constant):
            if isinstance(node.value, str):
                yield (Part(node.value),)
            elif node.value is not None:
                yield (Part(repr(node.value), "hole"),)
        elif isinstance(node, ast.JoinedStr):
            yield from self._fstring(node, depth)
        elif isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Div, ast.Add)):
            glue = (Part("/"),) if isinstance(node.op, ast.Div) else ()
            for left in self.value(node.left, depth + 1):
                for right in self.value(node.right, depth + 1):
                    yield left + glue + right
        elif isinstance(node, ast.BoolOp) and isinstance(node.op, ast.Or):
            for operand in node.values:
                yield from self.value(operand, depth + 1)
        elif isinstance(node, ast.IfExp):
            yield from self.value(node.body, depth + 1)
            yield from self.value(node.orelse, depth + 1)
        elif isinstance(node, ast.Subscript) and _is_environ(node.value):
            if isinstance(node.slice, ast.Constant):
                yield (Part(str(node.slice.value), "env"),)
        elif isinstance(node, ast.Call):
            yield from self._call(node, depth)
        elif (name := _last_name(node)) is not None:
            yield from self._name(name, ast.unparse(node), depth)
        else:
            yield (Part(ast.unparse(node), "hole"),)

    def _fstring(self, node: ast.JoinedStr, depth: int) -> Iterator[Alternative]:
        alts: list[Alternative] = [()]
        for piece in node.values:
            if isinstance(piece, ast.Constant):
                options: list[Alternative] = [(Part(str(piece.value)),)]
            elif isinstance(piece, ast.FormattedValue):
                options = self.value(piece.value, depth + 1)
                if not options or all(any(p.kind == "hole" for p in o) for o in options):
                    options = [(Part(ast.unparse(piece.value), "hole"),)]
            else:
                options = [(Part(ast.unparse(piece), "hole"),)]
            alts = [a + o for a in alts for o in options][:MAX_ALTERNATIVES]
        yield from alts

    def _call(self, call: ast.Call, depth: int) -> Iterator[Alternative]:
        name = _last_name(call.func)
        if _is_env_read(call):
            first = call.args[0] if call.args else None
            if isinstance(first, ast.Constant):
                yield (Part(str(first.value), "env"),)
            if len(call.args) > 1:
                yield from self.value(call.args[1], depth + 1)
            return
        if name in _JOINS and call.args:
            alts: list[Alternative] = [()]
            receiver = []
            if name in ("join", "joinpath") and isinstance(call.func, ast.Attribute):
                base = call.func.value
                if name == "joinpath" or not _is_module_path(base):
                    receiver = [base] if name == "joinpath" else []
            for i, arg in enumerate([*receiver, *call.args]):
                sep: Alternative = (Part("/"),) if i else ()
                alts = [a + sep + v for a in alts for v in self.value(arg, depth + 1)]
            yield from alts[:MAX_ALTERNATIVES]
            return
        if name in _PASS_THROUGH:
            if isinstance(call.func, ast.Attribute) and not _is_module_path(call.func.value):
                yield from self.value(call.func.value, depth + 1)  # path.resolve()
            elif call.args:
                yield from self.value(call.args[0], depth + 1)
            return
        yield (Part(ast.unparse(call), "hole"),)

    def _name(self, name: str, shown: str, depth: int) -> Iterator[Alternative]:
        flag_value = self._option(name)
        if flag_value is not None:
            yield (Part(flag_value),)
            return
        values = list(self.m.values.get(name, []))
        for fn, position, method in self.m.params.get(name, []):
            for call in self.m.calls.get(fn, []):
                if method != isinstance(call.func, ast.Attribute) and not _qualified(call):
                    continue  # torch.save(...) is not a call of the script's own save()
                kw = next((k.value for k in call.keywords if k.arg == name), None)
                if kw is not None:
                    values.append(kw)
                elif 0 <= position < len(call.args):
                    values.append(call.args[position])
        found = [alt for value in values for alt in self.value(value, depth + 1)]
        yield from found or [(Part(shown, "hole"),)]

    def _option(self, dest: str) -> str | None:
        """The job's ``--flag value`` for the argparse option stored under ``dest``."""
        for flag, value in self.overrides.items():
            if self.m.options.get(flag) == dest:
                return value
        return None


def _qualified(call: ast.Call) -> bool:
    """``module.Class(...)``: a constructor called through its module."""
    func = call.func
    return isinstance(func, ast.Attribute) and func.attr[:1].isupper()


def _is_environ(node: ast.expr) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == "environ"


def _is_env_read(call: ast.Call) -> bool:
    func = call.func
    if isinstance(func, ast.Attribute) and func.attr == "get" and _is_environ(func.value):
        return True
    return _last_name(func) == "getenv"


def _is_module_path(node: ast.expr) -> bool:
    """``os.path`` (or ``posixpath``): ``os.path.join(a, b)`` joins its arguments only."""
    return ast.unparse(node) in ("os.path", "path", "posixpath", "osp")
