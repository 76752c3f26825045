from acstudio.cli import main

raise SystemExit(main())
