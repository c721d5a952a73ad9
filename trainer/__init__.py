"""antifragile's 3D-parallel GPT trainer (built in issue 3)."""
