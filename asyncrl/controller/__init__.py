"""The controller builds the pools from one config and runs a mode's loop."""

from asyncrl.controller.run import run

__all__ = ["run"]
