"""A plain Flower App of the same model and data as a fedlt run, for benchmarks/flower_deployed_round.py: Flower's own
``FedAvg`` strategy (``Strategy.start``: a ``train`` and an ``evaluate`` message to every SuperNode each round) and a
ClientApp that trains the model by plain SGD on the client of the fedlt partition its SuperNode serves
(``partition-id``) and evaluates it on that client's test set. fedlt only builds the data and the initial model
(``fedlt.runner.rundir``), as the run's settings (the run config's ``fedlt``, JSON) say; nothing of fedlt's engine
runs. The benchmark copies this file into the App's folder as ``plainapp.py``."""
from __future__ import annotations

import json

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

server = ServerApp()
client = ClientApp()
_CACHE: dict = {}


def _setup(context: Context):
    """(settings, the fedlt federation, a fresh model) of the run, built once per process."""
    if "fed" not in _CACHE:
        from fedlt.config import RunConfig
        from fedlt.plugins import method_class
        from fedlt.runner.rundir import federation_for, make_spec

        cfg = RunConfig(**json.loads(str(context.run_config["fedlt"])))
        torch.set_num_threads(cfg.threads or 1)
        fed = federation_for(cfg)
        spec = make_spec(cfg, fed)
        cls = method_class(cfg)
        _CACHE.update(cfg=cfg, fed=fed, method=cls(spec, cls.make_params(cfg.params, cfg.allow_large)))
    return _CACHE["cfg"], _CACHE["fed"], _CACHE["method"].new_model()


@server.main()
def main(grid: Grid, context: Context) -> None:
    cfg, _, model = _setup(context)
    k = cfg.clients
    strategy = FedAvg(fraction_train=1.0, fraction_evaluate=1.0, min_train_nodes=k, min_evaluate_nodes=k,
                      min_available_nodes=k)
    strategy.start(grid=grid, initial_arrays=ArrayRecord(model.state_dict()), num_rounds=cfg.rounds,
                   train_config=ConfigRecord({"lr": cfg.lr}))


@client.train()
def train(msg: Message, context: Context) -> Message:
    cfg, fed, model = _setup(context)
    data = fed.clients[int(context.node_config["partition-id"])]
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=float(msg.content["config"]["lr"]), momentum=cfg.momentum,
                          weight_decay=cfg.weight_decay)
    model.train()
    gen = torch.Generator().manual_seed(cfg.seed)
    losses = []
    for x, y in data.batches(cfg.batch_size, gen, epochs=cfg.local_epochs):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(float(loss))
    return Message(RecordDict({"arrays": ArrayRecord(model.state_dict()), "metrics": MetricRecord(
        {"train_loss": sum(losses) / max(len(losses), 1), "num-examples": len(data)})}), reply_to=msg)


@client.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    cfg, fed, model = _setup(context)
    data = fed.clients[int(context.node_config["partition-id"])]
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    model.eval()
    right = seen = 0
    with torch.no_grad():
        for x, y in data.batches(256, torch.Generator(), shuffle=False, train=False):
            right += int((model(x).argmax(1) == y).sum())
            seen += len(y)
    return Message(RecordDict({"metrics": MetricRecord({"acc": right / max(seen, 1), "num-examples": seen})}),
                   reply_to=msg)
