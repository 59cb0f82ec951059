from oobleck_hpc.cli import main

raise SystemExit(main())
