"""A recipe's torch source (``source.factory = "module:function"``): imported from the recipe's folder, called.

Every problem is a FactoryError whose fix works; the import path and ``sys.modules`` are left as they were.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
from pathlib import Path
from typing import Any, Callable, Iterator

from model_factory.errors import FactoryError


@contextlib.contextmanager
def factory_import_path(folder: Path | None, module: str = "") -> Iterator[None]:
    """The recipe's folder first on the import path while a torch source is imported, called and exported.

    A factory module beside the recipe (``tiny_cnn.py`` for ``factory = "tiny_cnn:build"``) imports as a
    user expects, from any working directory and from the console script. Afterwards ``sys.path`` is as it
    was, and the modules imported from that folder are forgotten, so they leak into nothing else in the
    process (another recipe may have its own ``model.py``). A module of the same name (``module``) that
    was imported from elsewhere before is set aside meanwhile, so the one beside the recipe wins, and put
    back afterwards.
    """
    if folder is None:
        yield
        return
    root = Path(folder).resolve()
    top = module.split(".")[0]
    shadowed = {}
    if top and ((root / f"{top}.py").is_file() or (root / top / "__init__.py").is_file()):
        shadowed = {n: m for n, m in sys.modules.items() if n == top or n.startswith(top + ".")}
        for name in shadowed:
            del sys.modules[name]
    before = set(sys.modules)
    sys.path.insert(0, str(root))
    importlib.invalidate_caches()
    try:
        yield
    finally:
        try:
            sys.path.remove(str(root))
        except ValueError:  # the factory itself edited sys.path; nothing of ours is left to remove
            pass
        for name in set(sys.modules) - before:
            if _imported_from(sys.modules.get(name), name, root):
                del sys.modules[name]
        sys.modules.update(shadowed)


def _imported_from(module: Any, name: str, root: Path) -> bool:
    """Whether ``module`` (called ``name``) was imported from the folder ``root`` itself.

    Only ``root/a/b.py`` or ``root/a/b/__init__.py`` for ``a.b`` counts: a module found through another
    import-path entry that happens to lie below ``root`` (a virtual environment inside the project
    folder, say) is not the recipe's and stays imported.
    """
    origin = getattr(module, "__file__", None)
    if not origin:
        return False
    base = root.joinpath(*name.split("."))
    return Path(origin).resolve() in (base.with_name(base.name + ".py"), base / "__init__.py")


def load_factory(spec: str, folder: Path | None = None) -> tuple[Callable[[], Any], Path | None]:
    """Resolve ``module:function`` (call inside :func:`factory_import_path`); return it and its module file.

    Every problem is a FactoryError whose fix works: where the module was looked for, the dependency that
    is missing, or the functions the module does have.
    """
    mod_name, _, fn_name = spec.partition(":")
    where = f"beside the recipe ({folder})" if folder is not None else "in the current folder"
    try:
        mod = importlib.import_module(mod_name)
    except ModuleNotFoundError as exc:
        if exc.name and (mod_name == exc.name or mod_name.startswith(exc.name + ".")):
            file_hint = mod_name.replace(".", "/") + ".py"
            raise FactoryError(f"source.factory: no module {mod_name!r} {where} or installed. Fix: put "
                               f"{file_hint} {where}, or pip install the package that provides it") from exc
        raise FactoryError(f"source.factory: importing {mod_name!r} failed: {exc}. Fix: pip install the package "
                           f"that provides {exc.name!r} into this environment") from exc
    except Exception as exc:  # the user's module may raise anything while it is imported
        raise FactoryError(f"source.factory: importing {mod_name!r} raised {type(exc).__name__}: {str(exc)[:300]}. "
                           f"Fix: make `import {mod_name}` work when run {where}") from exc
    mod_file = getattr(mod, "__file__", None)
    fn = getattr(mod, fn_name, None)
    if not callable(fn):
        found = sorted(n for n, v in vars(mod).items() if callable(v) and not n.startswith("_")
                       and getattr(v, "__module__", None) == mod.__name__ and not isinstance(v, type))
        raise FactoryError(f"source.factory: {mod_name!r} ({mod_file}) has no function {fn_name!r}. Fix: define "
                           f"{fn_name}() returning (torch.nn.Module, example_inputs), or name one of: "
                           f"{', '.join(found) or 'none found'}")
    return fn, Path(mod_file) if mod_file else None


def call_factory(fn: Callable[[], Any], spec: str) -> tuple[Any, Any]:
    try:
        produced = fn()
    except Exception as exc:  # the user's factory may raise anything
        raise FactoryError(f"source.factory: {spec}() raised {type(exc).__name__}: {str(exc)[:300]}. Fix: make it "
                           "run with no arguments and return (torch.nn.Module, example_inputs)") from exc
    if not (isinstance(produced, tuple) and len(produced) == 2):
        raise FactoryError(f"source.factory: {spec}() returned {type(produced).__name__}. Fix: return "
                           "(torch.nn.Module, example_inputs), example_inputs a dict of input name to tensor")
    return produced
