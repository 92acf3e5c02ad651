"""Hybrid-parallel plans (DP x TP x PP, non-uniform), their cost model, the planner that
builds them from per-GPU rates (TP groups per node, ILP-A / ILP-B, top-k search) and what
moves between two plans; shared by Malleus, checkpoint recovery (Elastor), Hydraulis, HotSPa
and LobRA."""
