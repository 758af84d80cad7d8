"""Everything that speaks Lightning: the Trainer's strategy, Fabric's strategy, and what both share (precision,
processes); the monitor callback and the timeline. The layers below never import Lightning (tests/layers.py)."""
