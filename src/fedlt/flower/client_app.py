"""``fedlt.flower.client_app:app``: the one generic fedlt ClientApp, any registered method's client hooks on a
SuperNode's data. Each message type goes to its handler in :mod:`fedlt.engine.flower.client`, which says what
each does, where the data comes from and what leaves the SuperNode under ``--dp``."""
from flwr.clientapp import ClientApp

from ..engine.flower import client
from ..engine.flower.secagg import client_mod as secagg_mod

app = ClientApp()
app.query("describe")(client.describe)
app.train(mods=[secagg_mod])(client.train)  # a SecAgg+ round's messages through Flower's secaggplus_mod (--secagg)
app.train("evaluate")(client.train_evaluate)  # the previous round's evaluation riding in a training message
app.train("phase")(client.phase)
app.evaluate()(client.evaluate)
