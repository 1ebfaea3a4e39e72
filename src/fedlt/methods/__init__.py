"""One file per method. Every module in this package is imported when the method registry is first used,
so a new method needs no change anywhere else: drop a file that registers itself with ``@METHODS.register``."""
from ..core.method import Method
from ..registry import METHODS

METHODS.add_package(__name__, __path__)
METHODS.base = Method  # what a plugin's entry point must name a subclass of
