"""`python -m specdec_cli ...` is the `specdec` command."""

from specdec_cli.main import main

raise SystemExit(main())
