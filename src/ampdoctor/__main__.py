from ampdoctor.ui.cli import main

raise SystemExit(main())
