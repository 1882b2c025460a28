from ampdoctor.cli import main

raise SystemExit(main())
