"""DPGS logic shared by the Ray master (``master/``) and bag workers (``workers/``)."""
