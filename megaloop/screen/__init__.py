"""Learning-rate screens (SPEC §11); the command line is ``megaloop lr-screen`` (megaloop/screen/cli.py)."""
