"""Training SpecRoute's own drafters on the target's features (issue 3).

`corpus` builds the token corpus (public text on this machine, never Spec-Bench's held-out split), `features`
runs the target over it once (teacher forcing), `eagle` trains an EAGLE-1 head and `medusa`
Medusa-1 heads on the result; `common` holds what both share, `answers` writes chat data in
the target's own words.
`specroute train-drafter` (router/cli.py) drives them.
"""
