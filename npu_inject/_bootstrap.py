"""Start-up hook, run from the ``.pth`` line when TORCHTITAN_NPU is set.

Only ``sys`` is used here: the start-up path must not pay for wrapt,
importlib.metadata, torch or the registry. A tiny meta path finder waits for the
first ``import torchtitan``; only then is the runtime loaded, the configuration
validated and the post-import hooks registered.
"""

import sys


class TorchtitanImportTrigger:
    """Activates the runtime at the first ``import torchtitan``, then steps aside."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "torchtitan":
            return None
        uninstall()
        from npu_inject import runtime
        from npu_inject.errors import ConfigError

        try:
            runtime.activate()
        except ConfigError as exc:
            # One clear message, no traceback, nothing applied, no training.
            raise SystemExit(f"npu_inject: configuration error: {exc}") from None
        # Let the finders now in place (wrapt's hook finder first) find torchtitan, so a
        # post-import hook registered for "torchtitan" itself fires for this very import.
        import importlib.util

        return importlib.util.find_spec(fullname)


def install():
    if "torchtitan" in sys.modules:
        from npu_inject import runtime

        runtime.activate()
        return
    if not any(isinstance(finder, TorchtitanImportTrigger) for finder in sys.meta_path):
        sys.meta_path.insert(0, TorchtitanImportTrigger())


def uninstall():
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, TorchtitanImportTrigger)]
