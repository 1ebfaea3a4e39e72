"""Engines that drive a method's hooks: the run driver (``driver``) over an in-process transport (``simulation``)
or Flower's (``fedlt.flower``)."""
from .driver import Driver, EngineConfig, Transport, clients_per_round, sampling_schedule
from .simulation import Batched, InProcess, Simulation

__all__ = ["Batched", "Driver", "EngineConfig", "InProcess", "Simulation", "Transport", "clients_per_round",
           "sampling_schedule"]
