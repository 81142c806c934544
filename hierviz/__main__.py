from hierviz.cli import main

raise SystemExit(main())
