"""Learning-rate screens (SPEC §11); the command line is tools/lr_screen.py."""
