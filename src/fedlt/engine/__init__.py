"""The run driver and its engines, siblings over the driver's ``Transport``: in process, one client after another
(``inprocess``), batched (``batched``), in worker processes (``workers``) and on Flower (``fedlt.engine.flower``);
the simulator (``simulation``) drives the in-process ones."""
from .driver import Driver, EngineConfig, Transport, clients_per_round, sampling_schedule
from .simulation import Batched, InProcess, Simulation

__all__ = ["Batched", "Driver", "EngineConfig", "InProcess", "Simulation", "Transport", "clients_per_round",
           "sampling_schedule"]
