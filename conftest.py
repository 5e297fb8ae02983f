"""pytest's set-up for every test file."""
import zero


def pytest_configure(config):
    # zero.py silences torch 2.13's renaming of the two collectives at import; pytest resets the
    # warning filters for every test, so the same filter goes here
    config.addinivalue_line("filterwarnings", f"ignore:{zero.RENAMED}:FutureWarning")
