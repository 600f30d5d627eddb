"""The controller process: the step loop (`loop.Controller`), its config sections,
checkpoints of controller state, supervision of the actors, and step metrics.

No tensor math here. Import `torchtitan_rl.controller.loop` for the Controller (this package
stays import-light: `config.py` reads the section dataclasses of `controller.config`).
"""
