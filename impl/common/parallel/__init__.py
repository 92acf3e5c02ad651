"""Hybrid-parallel plans (DP x TP x PP, non-uniform) and their cost model; shared by Malleus,
Elastor, Hydraulis, HotSPa and LobRA."""
