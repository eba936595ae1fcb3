# %% [markdown]
# # Plot fixture
# One plotly figure, to check that the built page draws it in a real browser.

# %% tags=["parameters"]
profile = "unset"

# %%
import plotly.graph_objects as go

fig = go.Figure(go.Scatter(x=[1, 2, 3], y=[3, 1, 2], mode="lines+markers", name="fixture"))
fig.update_layout(title="fixture figure", height=300)
fig.show()
