import sys

try:
    from elastic.cli.main import main
except KeyboardInterrupt:  # Ctrl-C while the command is still loading: no traceback
    sys.exit(130)

main()
