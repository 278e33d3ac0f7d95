"""9P2000.L: a sans-I/O codec (bytes in, typed messages out) and an asyncio server.

Three rooms, as in crosvm's p9 (STYLE.md): ``messages``/``codec`` know only bytes;
``server`` owns sockets and framing, ``connection`` the fids and the message table;
:mod:`sandbox.serving` the export registry, hold gates and request pipeline; a :class:`~sandbox.mounts.Provider`
owns the host. Every mutation a guest makes reaches the host through the provider —
for an intercepted export, through the same ``InterceptedFS`` the simulation drives.
"""
