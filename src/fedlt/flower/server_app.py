"""``fedlt.flower.server_app:app``, the ServerApp of app directories written before the Flower engine moved to
:mod:`fedlt.engine.flower.server_app`."""
from ..engine.flower.server_app import app  # noqa: F401
