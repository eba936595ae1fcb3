# %% [markdown]
# # Failing fixture
# The second code cell raises, so the run must stop there with one clear error line.

# %% tags=["parameters"]
profile = "unset"

# %%
print("before the failure")

# %%
raise ValueError("fixture failure on purpose")

# %%
print("never reached")
