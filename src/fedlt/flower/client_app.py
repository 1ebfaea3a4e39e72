"""``fedlt.flower.client_app:app``, the ClientApp of app directories written before the Flower engine moved to
:mod:`fedlt.engine.flower.client_app`."""
from ..engine.flower.client_app import app  # noqa: F401
