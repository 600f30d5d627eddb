"""The controller process: the step loop (`loop.Controller`), where its processes come from
(`launcher`), the warm start, checkpoints and resume, supervision of the actors, and one
report per step.

No tensor math here. Import `torchtitan_rl.controller.loop` for the Controller (this package
stays import-light).
"""
