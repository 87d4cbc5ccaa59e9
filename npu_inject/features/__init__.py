"""Features the patches switch on (the Swap Optimizer); code that runs inside training processes."""
