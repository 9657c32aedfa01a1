from gptfast_kernels.cli import main

raise SystemExit(main())
