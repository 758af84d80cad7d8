"""Gradient compression on the training side (SmartComp)."""
