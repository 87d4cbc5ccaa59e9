"""Start-up hook, run from the ``.pth`` line when TORCHTITAN_NPU is set.

Only ``sys`` is used here: the start-up path must not pay for wrapt,
importlib.metadata, torch or the registry. A tiny meta path finder waits for
``torchtitan`` to be imported. Looking torchtitan up (``importlib.util.find_spec``,
pip, an IDE, ``pkgutil``, a test collector, ``npu-inject doctor``) activates
nothing: the finder only hands out a spec whose loader activates the runtime when
the package is actually executed -- before ``torchtitan/__init__.py`` runs, so
torch_npu is imported before any torchtitan code -- and then steps aside.
"""

import sys


class _ActivatingLoader:
    """Wraps torchtitan's own loader: activate the runtime, then execute the package."""

    def __init__(self, loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        uninstall()
        # The package keeps its real loader (importlib.resources, pkgutil and reloads use it).
        module.__loader__ = self.loader
        if module.__spec__ is not None:
            module.__spec__.loader = self.loader
        from npu_inject import runtime
        from npu_inject.errors import ConfigError, stop_run

        try:
            active = runtime.activate(install_hooks=False)
        except ConfigError as exc:
            # One clear message, no traceback, nothing applied, no training.
            stop_run(f"npu_inject: configuration error: {exc}")
        self.loader.exec_module(module)
        if active is not None:
            # Hooks go in once the package exists: the one for "torchtitan" itself fires now.
            active.install_hooks()

    def __getattr__(self, name):
        # Anything else a loader offers (get_resource_reader, is_package, ...) is the real one's.
        return getattr(self.loader, name)


class TorchtitanImportTrigger:
    """Hands out torchtitan's spec with an activating loader; activates nothing itself."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "torchtitan":
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _ActivatingLoader(spec.loader)
                return spec
        return None


def install():
    if "torchtitan" in sys.modules:
        from npu_inject import runtime

        runtime.activate()
        return
    if not any(isinstance(finder, TorchtitanImportTrigger) for finder in sys.meta_path):
        sys.meta_path.insert(0, TorchtitanImportTrigger())


def uninstall():
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, TorchtitanImportTrigger)]
