"""Gyre: elastic, event-sourced RL for extremely long-horizon coding agents."""
