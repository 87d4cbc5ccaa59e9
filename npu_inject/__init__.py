"""npu_inject: run unmodified upstream torchtitan on Ascend NPUs through import-time patches.

Importing this package is cheap and imports neither torch nor torchtitan.
"""

__version__ = "0.2.0"
