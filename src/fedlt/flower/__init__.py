"""The Flower engine's old place: it lives in :mod:`fedlt.engine.flower`, beside the other engines. These modules
keep the names that app directories written by an earlier ``fedlt flower app`` give their components
(``fedlt.flower.server_app:app``, ``fedlt.flower.client_app:app``), so such a directory still runs."""
