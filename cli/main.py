"""Placeholder replaced by the CLI module."""


def main() -> None:
    raise SystemExit("elastic CLI not built yet")
