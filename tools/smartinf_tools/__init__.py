"""The workshop: harnesses that test lightning-smartinf from outside, installed apart from the product.

- ``chaos`` (``smartinf-chaos``): SIGKILL ``smartinf-train`` at random moments, resume, compare bit for bit;
- ``faultfs`` and ``faults`` (``smartinf-faults``): a FUSE file system that fails on purpose, and the campaign over it;
- ``soak`` (``smartinf-soak``): a long run sampled from outside for leaks;
- ``gpu_report``: docs/gpu.md from what ``scripts/gpu_check.sh`` left on a GPU machine.
"""
