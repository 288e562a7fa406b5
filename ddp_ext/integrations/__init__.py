"""Adapters that make training frameworks wrap models in ddp_ext's DDP.

One module per framework, each imported only when used (``import ddp_ext``
imports none of them, nor any framework):

- ``ddp_ext.integrations.lightning``: ``DDPExtStrategy`` for ``lightning.Trainer``
- ``ddp_ext.integrations.fabric``: ``DDPExtStrategy`` for ``lightning.Fabric``
- ``ddp_ext.integrations.accelerate``: ``Accelerator`` for HF Accelerate

See docs/FRAMEWORKS.md.
"""
