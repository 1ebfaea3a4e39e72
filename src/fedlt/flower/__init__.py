"""fedlt on Flower: the apps over the Flower engine (:mod:`fedlt.engine.flower`)."""
