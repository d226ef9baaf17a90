"""Training SpecRoute's own drafters on the target's features (issue 3).

`corpus` builds the token corpus (public text on this machine, never Spec-Bench's held-out split), `features`
runs the target over it once (teacher forcing), `eagle` trains an EAGLE-1 head on the result.
`specroute train-drafter` (router/cli.py) drives them.
"""
