"""Drivers for engines kvsqueeze runs in a child process (vLLM), so their pinned libraries never meet ours.

A base layer: these modules import nothing of kvsqueeze above ``errors``, so evaluation (the vLLM peer) and
calibration/export (checking a checkpoint in vLLM) can both use them without importing each other.
"""
