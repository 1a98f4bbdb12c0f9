"""The ground every part stands on: the config mechanism (``config``), progress bars
(``progress``) and the one bounded HTTP server (``web``). It imports no other lightspan part."""
