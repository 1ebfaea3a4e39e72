"""Engines that drive a method's hooks: the in-process simulation (here) and Flower (fedlt.flower)."""
from .simulation import EngineConfig, Simulation, clients_per_round, sampling_schedule

__all__ = ["EngineConfig", "Simulation", "clients_per_round", "sampling_schedule"]
