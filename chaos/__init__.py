"""antifragile's chaos testbed: fault injection, recovery measurement and the `chaos` CLI."""
