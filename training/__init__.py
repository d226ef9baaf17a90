"""Training SpecRoute's own drafters on the target's features.

`corpus` builds the token corpus (public text on this machine, never Spec-Bench's held-out split),
`features` runs the target over it once (teacher forcing), and `trainer` runs one training loop for
every drafter kind: `eagle` (an EAGLE-1 head), `medusa` (Medusa-1 heads) and `model` (a distilled
small model) supply only what is their own. `args`, `data`, `loop`, `state` and `output` hold the
settings, inputs, steps, resumable state and written files the kinds share; `answers` writes chat
data in the target's own words. `specroute train-drafter` and `specroute gen-answers`
(router/cli.py) drive them. This package imports workers/ and policies/; of the rest, only the CLI
and bench/ import it.
"""
