"""`python -m plugin.config`: the configuration table (`plugin.config.table`)."""

from plugin.config.table import main

raise SystemExit(main())
