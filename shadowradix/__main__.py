import sys

if sys.argv[1:2] == ["fleet"]:  # a stop asked while it imports must still exit 0
    import signal

    from shadowradix import early_signals

    early_signals.catch(signal.SIGTERM, signal.SIGINT)

from shadowradix.cli import main  # after the signals are caught

sys.exit(main())
